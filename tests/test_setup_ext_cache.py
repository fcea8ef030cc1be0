"""setup.py's cache of the built C++ extension: installing again with nothing changed must not
compile (README command 1 run twice), and any change to what the build reads must compile anew."""

from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st

from tests.setup_py import setup_module

S = setup_module()
FLAGS = {"cxx": ["-O3", "-std=c++20"]}


def _files(tmp_path, contents: dict[str, bytes]) -> list[str]:
    out = []
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
        out.append(str(tmp_path / name))
    return out


@settings(max_examples=40, deadline=None)
@given(a=st.binary(max_size=64), b=st.binary(max_size=64), flip=st.integers(0, 63))
def test_the_key_changes_with_any_byte_of_any_input_and_only_then(tmp_path_factory, a, b, flip):
    d = tmp_path_factory.mktemp("k")
    files = _files(d, {"x.cpp": a, "y.h": b})
    key = S.ext_cache_key(files, FLAGS, "2.13.0", None)
    assert key == S.ext_cache_key(list(reversed(files)), FLAGS, "2.13.0", None)  # order of listing: same build
    if a:
        changed = bytearray(a)
        changed[flip % len(a)] ^= 0x01
        (d / "x.cpp").write_bytes(bytes(changed))
        assert S.ext_cache_key(files, FLAGS, "2.13.0", None) != key
        (d / "x.cpp").write_bytes(a)
    assert S.ext_cache_key(files, {"cxx": ["-O2", "-std=c++20"]}, "2.13.0", None) != key
    assert S.ext_cache_key(files, FLAGS, "2.14.0", None) != key
    assert S.ext_cache_key(files, FLAGS, "2.13.0", "12.8") != key


def test_a_file_renamed_with_the_same_bytes_is_another_build(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = S.ext_cache_key(_files(tmp_path / "a", {"x.cpp": b"int f();"}), FLAGS, "2.13.0", None)
    two = S.ext_cache_key(_files(tmp_path / "b", {"z.cpp": b"int f();"}), FLAGS, "2.13.0", None)
    assert one != two


def test_second_install_copies_the_first_build_and_compiles_nothing(tmp_path):
    cache, target, builds, log = tmp_path / "cache", tmp_path / "pkg" / "_C.so", [], []

    def build():
        builds.append(1)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"\x7fELF library")

    assert S.cached_build("k1", str(cache), str(target), build, log.append) is False
    target.unlink()  # a fresh checkout: the library is gone, the cache stays
    assert S.cached_build("k1", str(cache), str(target), build, log.append) is True
    assert builds == [1] and target.read_bytes() == b"\x7fELF library"
    assert "nothing compiled" in log[-1]
    # another key (a changed source) compiles again
    assert S.cached_build("k2", str(cache), str(target), build, log.append) is False and builds == [1, 1]


def test_cache_off_or_a_failed_build_leaves_nothing_to_reuse(tmp_path):
    target, builds = tmp_path / "_C.so", []

    def build():
        builds.append(1)
        target.write_bytes(b"lib")

    for _ in range(2):
        S.cached_build("k", None, str(target), build, lambda m: None)
    assert builds == [1, 1]

    def broken():
        raise RuntimeError("compiler error")

    cache = tmp_path / "cache"
    try:
        S.cached_build("k", str(cache), str(target), broken, lambda m: None)
    except RuntimeError:
        pass
    assert not (cache / "k").exists() or not any((cache / "k").iterdir())


def test_cache_dir_follows_the_environment(tmp_path):
    assert S.ext_cache_dir({"GYRE_EXT_CACHE": "0"}) is None
    assert S.ext_cache_dir({"GYRE_EXT_CACHE": str(tmp_path)}) == str(tmp_path)
    assert S.ext_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == os.path.join(str(tmp_path), "gyre", "ext")
