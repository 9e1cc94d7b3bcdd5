"""Per-request records as the repository keeps them: gzipped in place, read back alike, none left plain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl import cli
from hybridrl.run import request_records

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, steps: int = 2) -> Path:
    run = tmp_path / "run"
    (run / "requests").mkdir(parents=True)
    (run / "steps.jsonl").write_text("{}\n")
    for step in range(1, steps + 1):
        rows = [{"i": i, "seed": 100 * step + i, "prompt_tokens": 40 + i, "adapter": "policy"} for i in range(8)]
        (run / "requests" / f"step-{step:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_compact_gzips_each_step_beside_itself_and_reads_back_the_same_records(tmp_path: Path) -> None:
    run = _run(tmp_path)
    plain = [request_records.read(run, s) for s in (1, 2)]
    done = request_records.compact(run)
    assert done.files == 2 and 0 < done.after < done.before
    assert sorted(p.name for p in (run / "requests").iterdir()) == ["step-0001.jsonl.gz", "step-0002.jsonl.gz"]
    assert [request_records.read(run, s) for s in (1, 2)] == plain
    first = (run / "requests" / "step-0001.jsonl.gz").read_bytes()
    assert request_records.compact(run).files == 0  # nothing left to do
    assert (run / "requests" / "step-0001.jsonl.gz").read_bytes() == first
    with pytest.raises(FileNotFoundError, match="step-0003.jsonl"):
        request_records.read(run, 3)


def test_a_plain_file_beside_its_gzipped_one_wins_and_is_compacted_over_it(tmp_path: Path) -> None:
    run = _run(tmp_path, steps=1)
    request_records.compact(run)
    newer = [{"i": 0, "seed": 7, "prompt_tokens": 3}]  # the run resumed and wrote the step again
    (run / "requests" / "step-0001.jsonl").write_text(json.dumps(newer[0]) + "\n")
    assert request_records.read(run, 1) == newer
    request_records.compact(run)
    assert request_records.read(run, 1) == newer and not (run / "requests" / "step-0001.jsonl").exists()


def test_a_damaged_record_is_named_by_its_file_and_line(tmp_path: Path) -> None:
    import gzip

    run = _run(tmp_path, steps=1)
    request_records.compact(run)
    packed = run / "requests" / "step-0001.jsonl.gz"
    lines = gzip.decompress(packed.read_bytes()).decode().splitlines()
    packed.write_bytes(gzip.compress("\n".join([*lines[:2], lines[2][:15], *lines[3:]]).encode()))
    with pytest.raises(ValueError, match=rf"^{packed}:3: not a request record \(Expecting"):
        request_records.read(run, 1)


def test_the_cli_refuses_a_folder_that_is_not_a_run_and_touches_nothing(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path)
    with pytest.raises(SystemExit, match=r"hybridrl compact: .*elsewhere is not a run directory \(no steps.jsonl, "
                                         r"no requests/\)"):
        cli.main(["compact", str(run), str(tmp_path / "elsewhere")])
    assert (run / "requests" / "step-0001.jsonl").exists()  # checked all before compacting any
    cli.main(["compact", str(run)])
    assert "2 request files gzipped" in capsys.readouterr().out
    (run / "steps.jsonl").unlink()  # a run that died in its first step: its requests are still compacted
    (run / "requests" / "step-0003.jsonl").write_text('{"i": 0}\n')
    cli.main(["compact", str(run)])
    assert "1 request files gzipped" in capsys.readouterr().out


def test_the_committed_results_keep_no_plain_request_records() -> None:
    # results/reference only: a local `make smoke` writes its own runs under results/runs, plain and uncommitted
    committed = REPO / "results" / "reference"
    plain = sorted(p.relative_to(REPO).as_posix() for p in committed.glob("**/requests/step-*.jsonl"))
    assert not plain, f"run `python -m hybridrl compact` on these runs before committing them: {plain[:3]}"
