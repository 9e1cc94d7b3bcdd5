# Models: a Hugging Face download runs on the submit host (compute nodes often have no network); a random-init
# build, and its warm start, is a job like a run: on a GPU where the warm start trains on CUDA, so that it is
# scheduled (and, with node.sharing one_at_a_time, measured) like everything else on the node.
MODEL_RULES = {
    "model_download": [m for m, spec in STUDY.models.items() if "hf_id" in spec],
    "model_build": [m for m, spec in STUDY.models.items() if "hf_id" not in spec],
}


def model_gpus(wildcards) -> int:
    return model_build_gpus(STUDY.models[wildcards.model], FAKE_GPUS)


for _name, _models in MODEL_RULES.items():

    rule:
        name:
            _name
        input:
            corpus=f"{DATA_DIR}/train.jsonl",
            test=f"{DATA_DIR}/test.jsonl",  # a warm-started model's base accuracy is measured on it
        output:
            directory("resources/models/{model}"),
        log:
            "logs/model/{model}.log",
        wildcard_constraints:
            model="|".join(re.escape(m) for m in _models) or "(?!)",  # (?!) matches nothing
        conda:
            "../envs/hybridrl.yaml"
        # a warm start trains on the CPU's cores where there is no GPU; nothing else runs before the models anyway
        threads: CORES
        resources:
            gpu=model_gpus,
            slurm_extra=MODEL_SBATCH,
        params:
            spec=run_model_spec,
            prelude=lambda wildcards: prelude(None),
        shell:
            "{params.prelude}python -m hybridrl model --spec {params.spec:q} --corpus {input.corpus}"
            " --test {input.test} --out {output} > {log} 2>&1"
