rule aggregate:
    input:
        [run_done(rid) for rid in RUNS],
    output:
        csv="results/steps.csv",
        parquet="results/steps.parquet",
    log:
        "logs/aggregate.log",
    conda:
        "../envs/hybridrl.yaml"
    params:
        runs=expand("results/runs/{run_id}", run_id=RUNS),
    shell:
        "python -m hybridrl aggregate --runs {params.runs} --csv {output.csv}"
        " --parquet {output.parquet} > {log} 2>&1"


rule report:
    input:
        table="results/steps.parquet",
        # the report's TRL, start-bench and trainer-bench sections read these (results/bench/)
        bench=[
            job.output
            for job in MEASUREMENTS.values()
            if job.kind in ("peer_trl", "start_bench", "trainer_bench")
        ],
    output:
        md="results/report.md",
        html="results/report.html",
        plots=directory("results/plots"),
    log:
        "logs/report.log",
    conda:
        "../envs/hybridrl.yaml"
    params:
        title=f"hybridrl: {STUDY.name}",
    shell:
        "python -m hybridrl report --table {input.table} --md {output.md} --html {output.html}"
        " --plots {output.plots} --title {params.title:q} > {log} 2>&1"


rule archive:
    input:
        "results/report.html",
        "results/steps.csv",
        "results/steps.parquet",
        [run_done(rid) for rid in RUNS],
        [job.output for job in MEASUREMENTS.values()],
    output:
        f"results/archive/{STUDY.name}.tar.gz",
    log:
        f"logs/archive/{STUDY.name}.log",
    conda:
        "../envs/hybridrl.yaml"
    params:
        root=workflow.basedir,
        extra=[
            f"{workflow.basedir}/{p}"
            for p in [
                "config",
                "requirements",
                "containers",
                "workflow/schemas",
                "Snakefile",
            ]
            if Path(workflow.basedir, p).exists()
        ],
        runs=list(RUNS),
        bench=list(MEASUREMENTS),
    shell:
        "python -m hybridrl archive --results results --extra {params.extra} --runs {params.runs}"
        " --bench {params.bench} --root {params.root}"
        " --out {output} > {log} 2>&1"
        " && python -m hybridrl verify {output} >> {log} 2>&1"
