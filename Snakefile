# hybridrl: which rollout engine and placement make GRPO + LoRA fastest, measured and checked.
# `snakemake --cores 2 --configfile config/smoke.yaml` runs the embedded default on a CPU;
# `snakemake --profile slurm` runs config/config.yaml on a SLURM cluster.

# The GPU study unless --configfile names another; Snakemake would otherwise merge the two files.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/containers.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/cluster.smk"


# data and model download on the submit host: compute nodes often have no network
localrules: all, data, model, run_config, aggregate, report, archive


rule all:
    input:
        "results/report.html",
        "results/report.md",
        f"results/archive/{STUDY.name}.tar.gz",
    default_target: True
