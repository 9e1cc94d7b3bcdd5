import json
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from hybridrl.config import ConfigError, dataset_name, resolve  # noqa: E402

try:
    STUDY = resolve(config, source="config")
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None

RUNS = STUDY.runs
DATASET = dataset_name(STUDY.data)
DATA_DIR = f"resources/data/{DATASET}"


def run_spec(wildcards) -> str:
    """The resolved run as JSON: a params change reruns exactly that run."""
    rid = wildcards.run_id
    if rid not in RUNS:
        raise WorkflowError(f"run {rid} is not in this study; known runs: {', '.join(RUNS)}")
    run = RUNS[rid]
    return json.dumps({"run_id": rid, "run": run, "study": STUDY.name,
                       "engine_env": STUDY.engine_envs.get(run["engine"], {})}, sort_keys=True)


def run_gpus(wildcards) -> int:
    """Inference TP plus, for split, the trainer's own GPUs; CPU runs ask for none."""
    run = RUNS[wildcards.run_id]
    if run["device"] != "cuda":
        return 0
    return run["tp"] + (run["train_gpus"] if run["placement"] == "split" else 0)


def run_model(wildcards) -> str:
    return f"resources/models/{RUNS[wildcards.run_id]['model']}"


def run_threads(wildcards) -> int:
    """CPU runs take the whole machine, so two runs never share cores and skew each other's timings."""
    return workflow.cores if RUNS[wildcards.run_id]["device"] == "cpu" else 8
