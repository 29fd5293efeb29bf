"""The forwarded path's rule (SPEC 2 "Paths"), as a pure function."""

from __future__ import annotations

import pytest

from gateway.write.paths import climbs_above_base, names_another_host, path_escapes


@pytest.mark.parametrize(
    "path",
    [
        "//host",
        "//host/x",
        "/\\host",
        "/\\\\host",
        "/\\/host",
        "/http://host/x",
        "/https://host",
        "/HTTP://host",
        "/git+ssh://host",
        "/http:\\\\host",
        "/http:/\\host",
        # ... once the dot segments are removed, as a normalising server would
        "/x/..//host/steal",
        "/.//host/steal",
        "/%2e//host",
        "/./http://host",
        "/a/b/../..//host",
    ],
)
def test_a_path_that_names_another_host_is_refused(path: str) -> None:
    assert names_another_host(path) and path_escapes(path)


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/",
        "/x",
        "/http:%2F%2Fhost",
        "/@host",
        "/%40host",
        "/%2F%2Fhost",
        "/x//y",
        "/x/http://host",
        "/http:/host",
        "/1http://host",
        "/a%2f..%2fb",
        "/a/./b",
        "/a/b/../c",
        "/x/../y//z",
        "/a;b/c",
        "/a/b/..;/c",
    ],
)
def test_a_path_that_names_no_host_passes(path: str) -> None:
    assert not path_escapes(path)


@pytest.mark.parametrize(
    "path",
    [
        *("/..", "/../x", "/a/../../x", "/%2e%2e", "/.%2e/x", "/a/..%2f..%2fx", "/a/..%5c..%5cx"),
        # path parameters: `..;x` is `..` to Tomcat and the like
        *("/..;/x", "/a/..;/..;/internal", "/%2e%2e;x/", "/a/..;jsessionid=1/../x"),
    ],
)
def test_a_climb_above_the_base_is_refused(path: str) -> None:
    assert climbs_above_base(path) and path_escapes(path)
