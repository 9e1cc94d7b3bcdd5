"""The one atomic write helper: the target is the old one or the whole new one, never half."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hybridrl import atomic
from hybridrl.run.telemetry import append_record, read_records


class Boom(RuntimeError):
    pass


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_write_text_replaces_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.json"
    atomic.write_text(target, "old")
    atomic.write_text(target, "new", fsync=True)
    assert target.read_text() == "new"
    assert _leftovers(target.parent) == []


def test_a_new_file_gets_the_mode_open_would_give_and_a_replaced_one_keeps_its_own(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # open() under this process's umask
    target = tmp_path / "report.md"
    atomic.write_text(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)  # not mkstemp's 0600
    target.chmod(0o640)
    atomic.write_text(target, "newer")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_failed_write_leaves_the_old_file_intact(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(Boom), atomic.atomic_path(target) as tmp:
        tmp.write_text("half of the new")
        raise Boom
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_old_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")

    def no_rename(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_bytes(target, b"new")
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_append_record_is_the_old_file_or_the_old_file_plus_the_line(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "steps.jsonl"
    append_record(path, {"step": 1})
    before = path.read_bytes()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    append_record(path, {"step": 2})
    assert synced, "the record must reach the disk before it takes the name"
    assert [r["step"] for r in read_records(path)] == [1, 2]

    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        append_record(path, {"step": 3})
    assert path.read_bytes() == before + b'{"step": 2}\n'


def test_atomic_dir_replaces_a_directory_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    with atomic.atomic_dir(out) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(Boom), atomic.atomic_dir(out) as tmp:
        (tmp / "weights").write_text("half of v2")
        raise Boom
    assert (out / "weights").read_text() == "v1"
    with atomic.atomic_dir(out) as tmp:
        (tmp / "weights").write_text("v2")
    assert (out / "weights").read_text() == "v2"
    assert _leftovers(tmp_path) == []


def test_atomic_dir_replaces_a_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not ours")
    out = tmp_path / "model"
    out.symlink_to(elsewhere, target_is_directory=True)
    with atomic.atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not out.is_symlink() and (out / "config.json").exists()
    assert (elsewhere / "keep").read_text() == "not ours"  # the link goes, never what it pointed to


def test_a_full_disk_names_the_file_being_written_not_none_or_the_temp(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from hybridrl import cli

    target = tmp_path / "report.md"
    target.write_text("old")

    def full(self: Path, data: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")  # what a write() says: no file name

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as err:
        atomic.write_text(target, "new")
    assert err.value.filename == str(target) and err.value.errno == errno.ENOSPC
    assert cli.os_error_line(err.value).startswith(f"disk full while writing {target}: free space and rerun")
    monkeypatch.undo()
    assert target.read_text() == "old" and _leftovers(tmp_path) == []


@pytest.mark.parametrize("command", [["client-ceiling", "--requests", "8", "--tokens", "8", "--seconds", "0"],
                                     ["trainer-bench", "--shape", "tiny", "--device", "cpu", "--workdir", "W"]])
def test_a_long_command_refuses_an_output_it_cannot_write_before_it_measures(tmp_path: Path, command: list[str],
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture) -> None:
    from hybridrl import cli
    from hybridrl.engines import client_ceiling
    from hybridrl.tools import trainer_bench

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before its output was checked")

    monkeypatch.setattr(client_ceiling, "main", measured)
    monkeypatch.setattr(trainer_bench, "main", measured)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    argv = [str(tmp_path / "w") if a == "W" else a for a in command]
    assert cli.main([*argv, "--out", str(blocker / "out.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"hybridrl: {blocker}: File exists\n", err  # its folder cannot be made: a file has the name


def test_a_refused_temp_file_is_named_as_the_target_and_a_bare_not_found_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import tempfile

    from hybridrl import cli

    target = tmp_path / "report.md"

    def refused(prefix: str, suffix: str, dir: Path) -> tuple[int, str]:  # noqa: A002 (mkstemp's own name)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(Path(dir) / f"{prefix}x1y2{suffix}"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(FileNotFoundError) as err:
        atomic.write_text(target, "new")
    assert cli.os_error_line(err.value) == f"{target}: No such file or directory"
    assert cli.os_error_line(FileNotFoundError(str(tmp_path / "steps.parquet"))) == \
        f"not found: {tmp_path / 'steps.parquet'}"
