"""The chaos report keeps the run's settings, and is meant to be kept and shared:
a password in the store URL never reaches it."""

from __future__ import annotations

import argparse

from gateway.tools.chaos.report import _settings


def test_a_password_in_the_store_url_is_hidden() -> None:
    args = argparse.Namespace(
        store="postgresql://sink:s3cret@db.example:5432/gate", seed=7, json="r.json", keep=False
    )
    settings = _settings(args)
    assert settings == {"store": "postgresql://sink:***@db.example:5432/gate", "seed": 7}
    assert "s3cret" not in repr(settings)


def test_a_store_without_a_password_or_none_at_all_is_kept_as_given() -> None:
    assert _settings(argparse.Namespace(store="sqlite:///run.db"))["store"] == "sqlite:///run.db"
    assert _settings(argparse.Namespace(store=None))["store"] is None
