# hybridrl: which rollout engine and placement make GRPO + LoRA fastest, measured and checked.
# `snakemake --cores 2 --configfile config/smoke.yaml` runs the embedded default on a CPU;
# `snakemake --profile slurm` runs config/config.yaml on a SLURM cluster.

import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))

from hybridrl.study.config import ConfigError, load_yaml  # noqa: E402

# The GPU study unless --configfile names another; Snakemake would otherwise merge the two files.
if not workflow.overwrite_configfiles:
    # Snakemake's own parse of a broken file names no file, line or column (and blames tabs): read it
    # here first, and stop with one line (a WorkflowError would add a header and a traceback line).
    # A file given with --configfile is parsed by Snakemake before this file runs.
    if Path("config/config.yaml").exists():
        try:
            load_yaml("config/config.yaml")
        except ConfigError as exc:
            raise SystemExit(f"hybridrl: config error: {exc}") from None

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/containers.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/cluster.smk"


# data and model download on the submit host: compute nodes often have no network
localrules:
    all,
    data,
    model_download,
    run_config,
    aggregate,
    report,
    archive,


rule all:
    default_target: True
    input:
        "results/report.html",
        "results/report.md",
        f"results/archive/{STUDY.name}.tar.gz",
        [job.output for job in MEASUREMENTS.values()],
