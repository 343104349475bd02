"""The context directory: .detignore, defaults, symlinks, limits, shadowing and snapshots."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from det_local.errors import ContextError
from det_local.store import context as ctxmod
from det_local.store.context import (
    MAX_CONTEXT_BYTES,
    ContextFile,
    list_context,
    snapshot_context,
)

MiB = 1024 * 1024


def make_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def names(src: Path) -> list[str]:
    return [f.rel_path for f in list_context(src)]


def sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size)


# -- the context root --------------------------------------------------------------------------


def test_missing_context_names_path_and_remedy(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ContextError) as exc:
        list_context(missing)
    msg = str(exc.value)
    assert str(missing) in msg
    assert "does not exist" in msg
    assert "pass the directory holding your training code" in msg
    assert "\n" not in msg


def test_file_as_context_names_path_and_remedy(tmp_path: Path) -> None:
    f = tmp_path / "train.py"
    f.write_text("print(1)\n")
    with pytest.raises(ContextError) as exc:
        list_context(f)
    msg = str(exc.value)
    assert str(f) in msg
    assert "not a directory" in msg
    assert "not a file inside it" in msg


def test_lists_files_sorted_with_sizes(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx", {"b.py": "bb", "a.py": "a", "pkg/z.py": "zzz", "pkg/a.py": ""}
    )
    assert list_context(src) == [
        ContextFile("a.py", 1),
        ContextFile("b.py", 2),
        ContextFile("pkg/a.py", 0),
        ContextFile("pkg/z.py", 3),
    ]


def test_relative_context_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tree(tmp_path / "ctx", {"train.py": ""})
    monkeypatch.chdir(tmp_path)
    assert names(Path("ctx")) == ["train.py"]


# -- .detignore ---------------------------------------------------------------------------------


def test_detignore_basic_and_comments(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {
            ".detignore": "# a comment\n\n*.log\n",
            "train.py": "",
            "run.log": "",
            "sub/deep.log": "",
            "# a comment": "",
        },
    )
    assert names(src) == ["# a comment", "train.py"]


def test_detignore_file_itself_excluded_everywhere(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {".detignore": "", "sub/.detignore": "*", "sub/x.py": ""})
    assert names(src) == ["sub/x.py"]  # nested .detignore is neither read nor included


def test_detignore_negation(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "*.csv\n!keep.csv\n", "a.csv": "", "keep.csv": "", "d/keep.csv": ""},
    )
    assert names(src) == ["d/keep.csv", "keep.csv"]


def test_detignore_negation_inside_directory_glob(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "data/*\n!data/keep.txt\n", "data/big.bin": "", "data/keep.txt": ""},
    )
    assert names(src) == ["data/keep.txt"]


def test_detignore_cannot_reinclude_inside_ignored_dir(tmp_path: Path) -> None:
    # As in git: once a directory is excluded, its files cannot be brought back.
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "data/\n!data/keep.txt\n", "data/keep.txt": "", "t.py": ""},
    )
    assert names(src) == ["t.py"]


def test_detignore_double_star(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {
            ".detignore": "**/cache/*.npy\nlogs/**\n",
            "cache/a.npy": "",
            "x/y/cache/b.npy": "",
            "x/y/cache/c.txt": "",
            "logs/a/b.txt": "",
            "t.py": "",
        },
    )
    assert names(src) == ["t.py", "x/y/cache/c.txt"]


def test_detignore_anchored(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "/build\n", "build/x.o": "", "src/build/y.py": "", "t.py": ""},
    )
    assert names(src) == ["src/build/y.py", "t.py"]


def test_detignore_directory_only(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "out/\n", "out/a.txt": "", "sub/out/b.txt": "", "other/out": "file"},
    )
    assert names(src) == ["other/out"]


def test_detignore_escaped_characters(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {
            ".detignore": "\\#hash.txt\n\\!bang.txt\n",
            "#hash.txt": "",
            "!bang.txt": "",
            "t.py": "",
        },
    )
    assert names(src) == ["t.py"]


def test_invalid_detignore_pattern_names_line(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {".detignore": "*.log\n!\n", "t.py": ""})
    with pytest.raises(ContextError) as exc:
        list_context(src)
    msg = str(exc.value)
    assert f"{src / '.detignore'}:2" in msg
    assert ".gitignore syntax" in msg


# -- defaults -----------------------------------------------------------------------------------


def test_bytecode_always_skipped_even_when_negated(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {
            ".detignore": "!__pycache__/\n!*.pyc\n!**/__pycache__/**\n",
            "t.py": "",
            "t.pyc": b"\0",
            "__pycache__/t.cpython-311.pyc": b"\0",
            "pkg/__pycache__/m.cpython-311.pyc": b"\0",
            "pkg/__pycache__/notes.txt": "",
            "pkg/m.py": "",
        },
    )
    assert names(src) == ["pkg/m.py", "t.py"]


def test_git_and_ide_dirs_skipped_by_default(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {
            ".git/HEAD": "ref",
            ".idea/x.xml": "",
            ".vscode/settings.json": "",
            ".mypy_cache/x": "",
            "t.py": "",
        },
    )
    assert names(src) == ["t.py"]


def test_git_default_can_be_negated(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {".detignore": "!.git/\n", ".git/HEAD": "ref", "t.py": ""})
    assert names(src) == [".git/HEAD", "t.py"]


# -- symlinks -----------------------------------------------------------------------------------


def test_symlinked_files_copied_as_content(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("from outside")
    src = make_tree(tmp_path / "ctx", {"real.txt": "inside"})
    (src / "in_link.txt").symlink_to("real.txt")
    (src / "out_link.txt").symlink_to(outside)
    (src / "broken.txt").symlink_to(tmp_path / "missing")
    assert list_context(src) == [
        ContextFile("in_link.txt", 6),
        ContextFile("out_link.txt", 12),
        ContextFile("real.txt", 6),
    ]
    snap = tmp_path / "snap"
    snapshot_context(src, snap)
    assert not (snap / "out_link.txt").is_symlink()
    assert (snap / "out_link.txt").read_text() == "from outside"
    assert (snap / "in_link.txt").read_text() == "inside"
    assert not (snap / "broken.txt").exists()


def test_symlinked_dirs_inside_followed_outside_and_loops_skipped(tmp_path: Path) -> None:
    data = make_tree(tmp_path / "dataset", {"huge.bin": "x"})
    src = make_tree(tmp_path / "ctx", {"lib/util.py": "u", "t.py": ""})
    (src / "data").symlink_to(data, target_is_directory=True)
    (src / "alias").symlink_to("lib", target_is_directory=True)
    (src / "lib" / "loop").symlink_to("..", target_is_directory=True)
    (src / "self").symlink_to(".", target_is_directory=True)
    assert names(src) == ["alias/util.py", "lib/util.py", "t.py"]


def test_symlinked_dir_respects_detignore_by_link_path(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {".detignore": "alias/\n", "lib/util.py": ""})
    (src / "alias").symlink_to("lib", target_is_directory=True)
    assert names(src) == ["lib/util.py"]


def test_fifo_skipped(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"t.py": ""})
    os.mkfifo(src / "pipe")
    assert names(src) == ["t.py"]


# -- size limit ---------------------------------------------------------------------------------


def test_oversized_context_lists_largest_files(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"train.py": "print(1)\n"})
    sparse(src / "data" / "big.bin", 100 * MiB)
    for i in range(6):
        sparse(src / "data" / f"small{i}.bin", (i + 1) * 1024)
    with pytest.raises(ContextError) as exc:
        list_context(src)
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"context {src} is 100.0 MiB in 8 files, over the 95.0 MiB limit" in msg
    assert "largest files: data/big.bin (100.0 MiB), data/small5.bin (6.0 KiB)" in msg
    assert "data/small2.bin (3.0 KiB); add them" in msg
    assert "small1.bin" not in msg  # only the five largest
    assert "train.py" not in msg
    assert f"add them to {src / '.detignore'} or move data outside the context" in msg


def test_oversized_context_checked_before_copying(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"a.py": ""})
    sparse(src / "a.bin", 60 * MiB)
    sparse(src / "b.bin", 60 * MiB)
    dest = tmp_path / "snaps" / "exp1"
    with pytest.raises(ContextError, match="b.bin"):
        snapshot_context(src, dest)
    assert not dest.exists()
    assert not (tmp_path / "snaps").exists() or list((tmp_path / "snaps").iterdir()) == []


def test_context_at_exactly_the_limit_is_fine(tmp_path: Path) -> None:
    src = tmp_path / "ctx"
    sparse(src / "a.bin", MAX_CONTEXT_BYTES)
    assert list_context(src) == [ContextFile("a.bin", MAX_CONTEXT_BYTES)]


def test_oversized_files_excluded_by_detignore_are_fine(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {".detignore": "data/\n", "t.py": ""})
    sparse(src / "data" / "big.bin", 200 * MiB)
    assert names(src) == ["t.py"]


def test_symlink_to_outside_large_dir_does_not_count(tmp_path: Path) -> None:
    sparse(tmp_path / "datasets" / "big.bin", 200 * MiB)
    src = make_tree(tmp_path / "ctx", {"t.py": ""})
    (src / "data").symlink_to(tmp_path / "datasets", target_is_directory=True)
    assert names(src) == ["t.py"]


# -- shadowing `determined` ---------------------------------------------------------------------


def test_determined_package_shadowing_refused(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"determined/__init__.py": "", "t.py": ""})
    with pytest.raises(ContextError) as exc:
        list_context(src)
    msg = str(exc.value)
    assert f"context {src} has a top-level package determined/" in msg
    assert "would shadow the `determined` API" in msg
    assert f"rename it, or add `/determined` to {src / '.detignore'}" in msg


def test_determined_module_shadowing_refused(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"determined.py": "", "t.py": ""})
    with pytest.raises(ContextError) as exc:
        snapshot_context(src, tmp_path / "snap")
    assert "top-level module determined.py" in str(exc.value)
    assert "`/determined.py`" in str(exc.value)
    assert not (tmp_path / "snap").exists()


def test_determined_excluded_by_detignore_is_fine(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "/determined\n", "determined/__init__.py": "", "t.py": ""},
    )
    assert names(src) == ["t.py"]


def test_nested_or_namespace_determined_is_fine(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {
            "vendor/determined/__init__.py": "",  # not importable as top-level `determined`
            "determined/README.md": "",  # namespace dir: the real package still wins
            "determined_utils.py": "",
        },
    )
    assert names(src) == [
        "determined/README.md",
        "determined_utils.py",
        "vendor/determined/__init__.py",
    ]


# -- unreadable files ---------------------------------------------------------------------------


def make_unreadable(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make the open fail the way it would for a user
        real_open = os.open
        target = str(path)

        def fake_open(p: str, flags: int, *args: int) -> int:
            if str(p) == target:
                raise PermissionError(13, "Permission denied", str(p))
            return real_open(p, flags, *args)

        monkeypatch.setattr(ctxmod.os, "open", fake_open)


def test_unreadable_file_names_file_and_remedy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "ctx", {"t.py": "", "secret/key.pem": "k"})
    make_unreadable(src / "secret" / "key.pem", monkeypatch)
    with pytest.raises(ContextError) as exc:
        snapshot_context(src, tmp_path / "snap")
    msg = str(exc.value)
    assert f"in context {src}: secret/key.pem (Permission denied)" in msg
    assert f"fix their permissions or add them to {src / '.detignore'}" in msg
    assert not (tmp_path / "snap").exists()


def test_unreadable_file_excluded_by_detignore_is_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "ctx", {".detignore": "*.pem\n", "t.py": "", "key.pem": "k"})
    make_unreadable(src / "key.pem", monkeypatch)
    assert names(src) == ["t.py"]


def test_unreadable_directory_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "ctx", {"t.py": "", "private/x.py": ""})
    private = src / "private"
    private.chmod(0)
    if os.geteuid() == 0:  # root lists anything: fail the listing the way it would for a user
        real_scandir = os.scandir

        def fake_scandir(p: str) -> object:
            if str(p) == str(private):
                raise PermissionError(13, "Permission denied", str(p))
            return real_scandir(p)

        monkeypatch.setattr(ctxmod.os, "scandir", fake_scandir)
    try:
        with pytest.raises(ContextError) as exc:
            list_context(src)
        assert f"in context {src}: private/ (Permission denied)" in str(exc.value)
    finally:
        private.chmod(0o755)


# -- snapshots ----------------------------------------------------------------------------------


def test_snapshot_is_isolated_from_later_edits(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"train.py": "v1", "lib/m.py": "m1"})
    dest = tmp_path / "home" / "snapshots" / "exp-1"
    files = snapshot_context(src, dest)
    assert files == [ContextFile("lib/m.py", 2), ContextFile("train.py", 2)]

    (src / "train.py").write_text("v2 edited after submission")
    (src / "lib" / "m.py").unlink()
    (src / "new.py").write_text("new")

    assert (dest / "train.py").read_text() == "v1"
    assert (dest / "lib" / "m.py").read_text() == "m1"
    assert not (dest / "new.py").exists()
    assert os.stat(dest / "train.py").st_ino != os.stat(src / "train.py").st_ino


def test_snapshot_keeps_exec_bit_and_mode(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"startup-hook.sh": "#!/bin/sh\n", "ro.txt": "r"})
    (src / "startup-hook.sh").chmod(0o755)
    (src / "ro.txt").chmod(0o444)
    dest = tmp_path / "snap"
    snapshot_context(src, dest)
    assert os.access(dest / "startup-hook.sh", os.X_OK)
    assert stat.S_IMODE((dest / "startup-hook.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "ro.txt").stat().st_mode) == 0o444


def test_snapshot_recreates_empty_dirs_and_skips_ignored(tmp_path: Path) -> None:
    src = make_tree(
        tmp_path / "ctx",
        {".detignore": "*.ckpt\n", "t.py": "", "ckpts/a.ckpt": "", "__pycache__/t.pyc": ""},
    )
    (src / "outputs").mkdir()
    dest = tmp_path / "snap"
    snapshot_context(src, dest)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == [
        "ckpts",
        "outputs",
        "t.py",
    ]


def test_snapshot_refuses_existing_destination(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"t.py": ""})
    dest = tmp_path / "snap"
    dest.mkdir()
    with pytest.raises(ContextError) as exc:
        snapshot_context(src, dest)
    assert str(dest) in str(exc.value)
    assert "already exists" in str(exc.value)


def test_snapshot_failure_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "ctx", {"a.py": "a", "b.py": "b"})
    parent = tmp_path / "snaps"
    real_copy2 = shutil.copy2

    def failing_copy2(s: str, d: Path) -> object:
        if str(s).endswith("b.py"):
            raise OSError(5, "Input/output error")
        return real_copy2(s, d)

    monkeypatch.setattr(ctxmod.shutil, "copy2", failing_copy2)
    with pytest.raises(ContextError) as exc:
        snapshot_context(src, parent / "exp-1")
    assert f"cannot copy b.py from context {src}: Input/output error" in str(exc.value)
    assert list(parent.iterdir()) == []  # no destination, no temporary sibling


def test_snapshot_of_context_containing_destination(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "ctx", {"t.py": "t"})
    dest = src / "snapshots" / "exp-1"
    files = snapshot_context(src, dest)
    assert files == [ContextFile("t.py", 1)]
    assert sorted(p.name for p in dest.iterdir()) == ["t.py"]
