"""The tracked tree holds source and documentation: no binary (wheel, archive, shared library,
executable, image outside the reports) and no file over ~1 MB, except under ``reports/`` (figures
and run records the reports show) and the test data folders (``tests/data``, ``tests/fixtures``).
A stray binary grows every clone for good once it is committed, so this reads ``git ls-files``.
"""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_BYTES = 1_000_000
ALLOWED_DIRS = ("reports/", "tests/data/", "tests/fixtures/")
# Names that are binary whatever their first bytes say (a zip starts with printable "PK").
BINARY_SUFFIXES = (".whl", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".jar",
                   ".egg", ".so", ".dylib", ".dll", ".exe", ".a", ".o", ".pyc", ".pyd", ".bin",
                   ".npz", ".npy", ".pkl", ".pickle", ".msgpack", ".safetensors", ".pt", ".pth",
                   ".ckpt", ".h5", ".png", ".jpg", ".jpeg", ".gif", ".pdf")


def offending_files(root: str, paths: list[str]) -> dict[str, str]:
    """``{path: reason}`` for each tracked path (relative, '/'-separated) outside the allowed
    folders that is a binary (by name, or by a NUL byte in its first 8 KiB) or over MAX_BYTES."""
    out = {}
    for rel in paths:
        if rel.startswith(ALLOWED_DIRS):
            continue
        path = os.path.join(root, rel)
        if not os.path.isfile(path):  # deleted in the work tree, or a submodule
            continue
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8192)
        if rel.lower().endswith(BINARY_SUFFIXES) or b"\0" in head:
            out[rel] = f"binary ({size:,} bytes)"
        elif size > MAX_BYTES:
            out[rel] = f"{size:,} bytes (over {MAX_BYTES:,})"
    return out


def _tracked() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if done.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist): nothing is tracked")
    return [p for p in done.stdout.decode().split("\0") if p]


def test_the_check_finds_wheels_binaries_and_large_files(tmp_path):
    """The check below can fail: a wheel, a file with NUL bytes and a large text file outside the
    allowed folders are found; the same files under reports/ and tests/data are not."""
    (tmp_path / "tool-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 looks like text")
    (tmp_path / "blob").write_bytes(b"abc\0def")
    (tmp_path / "big.txt").write_text("x" * (MAX_BYTES + 1))
    (tmp_path / "ok.py").write_text("print('hi')\n")
    for folder in ("reports", "tests/data"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "blob").write_bytes(b"abc\0def")
        (tmp_path / folder / "big.txt").write_text("x" * (MAX_BYTES + 1))
    paths = ["tool-1.0-py3-none-any.whl", "blob", "big.txt", "ok.py", "reports/blob", "reports/big.txt",
             "tests/data/blob", "tests/data/big.txt"]
    found = offending_files(str(tmp_path), paths)
    assert set(found) == {"tool-1.0-py3-none-any.whl", "blob", "big.txt"}, found


def test_no_binary_or_large_file_is_tracked_outside_reports_and_test_data():
    found = offending_files(ROOT, _tracked())
    assert not found, ("tracked binaries or large files outside reports/ and tests/data, "
                       f"tests/fixtures (remove them with `git rm`, or keep them out of the repository): {found}")
