"""The SQLite lease store's adapters: the same values bound, and a program's own
adapter, registered before the store is imported, left as it is."""

from __future__ import annotations

import sqlite3
import subprocess
import sys


def test_an_adapter_the_program_registered_first_is_kept() -> None:
    code = (
        "import sqlite3\n"
        "sqlite3.register_adapter(type(None), lambda v: '')\n"
        "import leases.sqlite\n"
        "db = sqlite3.connect(':memory:')\n"
        "print(repr(db.execute('select ?', (None,)).fetchone()[0]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "''"


def test_the_values_bound_are_the_defaults() -> None:
    import leases.sqlite  # noqa: F401 - registers its adapters
    from leases.reasons import Reason

    db = sqlite3.connect(":memory:")
    row = db.execute("select ?, typeof(?), ?", (None, None, Reason.DUPLICATE)).fetchone()
    assert row == (None, "null", "duplicate")
