"""`StoreKind` (`training.store_kinds`): what each store scheme can do, declared once.

Every scheme the job model accepts has a kind; the kind's answers agree with the rules each module
spelled as scheme comparisons before (kept here, literally, as the oracle) on drawn URIs; the fsspec
package a kind names is the one fsspec itself would import.
"""

from __future__ import annotations

from urllib.parse import urlparse

from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from training.checkpoint.storage import ATOMIC_CREATE_SCHEMES, open_storage
from training.checkpoint_config import StoreConfig, store_location
from training.store_kinds import STORE_KINDS, SUPPORTED_STORE_SCHEMES, scheme_of, store_kind

# The rules as the modules wrote them before the registry (checks.py, pod_recreations.py, _pod.py, ...).
OLD_SUPPORTED = ("file", "s3", "gs", "gcs", "az", "abfs", "memory")
OLD_OBJECT = ("s3", "gs", "gcs", "az", "abfs")
OLD_ATOMIC = ("file", "s3", "memory")
OLD_SAME_SCHEME = {"gcs": "gs", "abfs": "az"}


def old_shared(scheme: str, pvc: str | None) -> bool:
    return scheme not in ("file", "memory") or pvc is not None


schemes = st.sampled_from([*OLD_SUPPORTED, "http", "hdfs", "ftp", "S3", "file2", ""])
segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=0, max_size=12)


@st.composite
def uris(draw: st.DrawFn) -> str:
    path = "/".join(draw(st.lists(segment, max_size=4)))
    form = draw(st.sampled_from(["scheme", "bare", "dot"]))
    if form == "bare":
        return path or "x"
    if form == "dot":
        return f"file://./{path}"
    return f"{draw(schemes)}://{draw(segment)}/{path}"


def test_every_supported_scheme_has_a_kind_in_the_documented_order() -> None:
    # The order is in messages users see ("use one of: file, s3, ...").
    assert SUPPORTED_STORE_SCHEMES == OLD_SUPPORTED == tuple(STORE_KINDS)
    assert ATOMIC_CREATE_SCHEMES == OLD_ATOMIC
    for scheme, kind in STORE_KINDS.items():
        assert kind.scheme == scheme
        assert kind.service in STORE_KINDS and STORE_KINDS[kind.service].service == kind.service
        assert sum([kind.filesystem, kind.in_process, kind.object_store]) == 1


def test_each_kind_names_the_package_fsspec_imports() -> None:
    from fsspec.registry import known_implementations

    for scheme, kind in STORE_KINDS.items():
        module = known_implementations[scheme]["class"].split(".")[0]
        assert kind.package == (None if module == "fsspec" else module), scheme


@given(uris(), st.sampled_from([None, "claim"]))
def test_the_kind_agrees_with_the_old_scheme_rules(uri: str, pvc: str | None) -> None:
    scheme = urlparse(uri).scheme if "://" in uri else "file"  # as every module derived it before
    assert scheme_of(uri) == scheme
    try:
        store = StoreConfig(uri=uri, pvc=pvc)
    except ValidationError as e:
        # Refused by the model: an unknown scheme (listing the known ones), or a malformed URI.
        if scheme not in OLD_SUPPORTED:
            assert f"unsupported scheme {scheme!r}; use one of: {', '.join(OLD_SUPPORTED)}" in str(e)
        return
    assert scheme in OLD_SUPPORTED  # every accepted store has a kind
    kind = store_kind(uri)
    assert store.kind is kind
    assert kind.filesystem == (scheme == "file")
    assert kind.in_process == (scheme == "memory")
    assert kind.object_store == (scheme in OLD_OBJECT)
    assert kind.atomic_create == (scheme in OLD_ATOMIC)
    assert store.shared == old_shared(scheme, store.pvc)
    assert (pvc is None) or scheme == "file"  # pvc on another kind is refused
    # One service under two names is one place.
    if "://" in uri and scheme != "file":
        assert store_location(uri).split("://")[0] == OLD_SAME_SCHEME.get(scheme, scheme)


@given(uris())
def test_the_storage_reports_its_kinds_atomicity(uri: str) -> None:
    try:
        kind = store_kind(uri)
    except ValueError:
        return
    if kind.in_process or kind.filesystem:  # the others would need their fsspec package and a network
        path = uri if kind.in_process else "file:///tmp/torchrig-store-kinds-test"
        assert open_storage(path).atomic_create == kind.atomic_create


def test_a_scheme_in_capitals_is_the_same_place() -> None:
    """URI schemes are case-insensitive (RFC 3986 3.1): `S3://b/x` and `s3://b/x` are one place, and two
    stores in one place race each other's writes while the user counts two copies."""
    assert store_location("S3://bucket/x") == store_location("s3://bucket/x")
    assert store_location("FILE://./ckpt") == store_location("./ckpt")
