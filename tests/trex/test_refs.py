import pytest

from trex.core.refs import MissingInputError, check_ref, read_manifest, ref_of, write_manifest


def test_manifest_hash_and_check(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    ref = write_manifest(tmp_path, "data", {"counts": {"a": 1}})
    assert check_ref(ref) and check_ref(ref, deep=True)
    assert read_manifest(tmp_path, "data")["counts"] == {"a": 1}
    assert ref_of(tmp_path, "data") == ref
    (tmp_path / "a.txt").write_text("y")
    assert check_ref(ref) and not check_ref(ref, deep=True)


def test_missing_and_wrong_kind(tmp_path):
    with pytest.raises(MissingInputError, match="does not exist"):
        ref_of(tmp_path / "nope", "data")
    with pytest.raises(MissingInputError, match="no manifest.json"):
        ref_of(tmp_path, "data")
    write_manifest(tmp_path, "model", {})
    with pytest.raises(MissingInputError, match="expected a 'data' directory"):
        ref_of(tmp_path, "data")
