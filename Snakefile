# hybridrl: which rollout engine and placement make GRPO + LoRA fastest, measured and checked.
# `snakemake --cores 2 --configfile config/smoke.yaml` runs the embedded default on a CPU;
# `snakemake --profile slurm` runs config/config.yaml on a SLURM cluster.

configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


localrules: all, aggregate, report, archive


rule all:
    input:
        "results/report.html",
        "results/report.md",
        f"results/archive/{STUDY.name}.tar.gz",
    default_target: True
