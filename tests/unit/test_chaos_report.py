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


def test_an_upper_case_sqlite_scheme_names_the_file_given(tmp_path) -> None:
    """`SQLITE:///data/x.db` went to the generated config as it was, relative to the
    gateway's work dir, while the checks read the file named: false violations."""
    from gateway.tools.chaos.run import _store_url

    assert _store_url("SQLITE:////abs/x.db", tmp_path) == "sqlite:////abs/x.db"
    assert _store_url("SQLite:///rel/x.db", tmp_path).endswith("/rel/x.db")
    assert _store_url("SQLite:///rel/x.db", tmp_path).startswith("sqlite:////")


def test_an_empty_section_reads_none() -> None:
    from gateway.tools.chaos.report import render

    report = {"settings": {"seed": 1}, "mode": "gateway", "elapsed_s": 1.0, "leases_lost": {},
              "violation_examples": {}, "unexpected": [], "violation_count": 0}  # fmt: skip
    assert "leases_lost                                  none" in render(report)
