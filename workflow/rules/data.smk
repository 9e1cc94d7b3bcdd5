rule data:
    output:
        train=f"{DATA_DIR}/train.jsonl",
        test=f"{DATA_DIR}/test.jsonl",
    log:
        f"logs/data/{DATASET}.log",
    conda:
        "../envs/hybridrl.yaml"
    params:
        source=DATA["source"],
        n_train=DATA["n_train"],
        n_test=DATA["n_test"],
        seed=DATA["seed"],
        steps=DATA["steps"],
        out=lambda wildcards, output: Path(output.train).parent,
    # tee: a failure's cause (no network, a checksum) shows on the console, not only in the log
    shell:
        "python -m hybridrl data --source {params.source} --n-train {params.n_train}"
        " --n-test {params.n_test} --seed {params.seed} --steps {params.steps} --out {params.out} 2>&1 | tee {log}"
