# Checks that stop a study before anything is submitted, each with one message naming the fix:
# a missing apptainer (or wheelhouse environment) for the GPU runs, a run that needs more GPUs than the
# profile allows, a missing or unknown account or partition, and a status source that cannot work.
# The first two need only the config and run while the Snakefile is parsed (a dry run only warns);
# the SLURM ones need the executor and the jobs' resources, so they run in `onstart`, which Snakemake
# calls after building the DAG and before it schedules the first job. A dry run never calls `onstart`,
# so it warns about the account and partition from the profile's default-resources instead. Job steps
# (inside SLURM) skip all.


def _gpu_limit() -> int | None:
    gpu = workflow.global_resources.get("gpu")
    value = getattr(gpu, "value", gpu)
    return value if isinstance(value, int) else None


def _parse_time_problems() -> list[str]:
    problems = cluster.check_gpu_limit(
        {rid: cluster.job_gpus(run, fake=FAKE_GPUS) for rid, run in RUNS.items()},
        _gpu_limit(),
    )
    if DEPLOY == "apptainer":
        problems += cluster.check_apptainer(CONTAINER_RUNS, SDM_APPTAINER)
    elif DEPLOY == "venv":
        problems += cluster.check_venvs(
            Path(workflow.basedir),
            {
                cluster.backend(r["engine"])
                for r in RUNS.values()
                if r["device"] == "cuda"
            },
        )
    return problems


def _profile_problems() -> list[str]:
    """A dry run never calls `onstart` (below), so it judges the account and partition the profile gives."""
    defaults = getattr(workflow.resource_settings.default_resources, "args", None)
    return cluster.check_profile_defaults(defaults, cluster.cluster_partitions)


if workflow.is_main_process:
    _problems = _parse_time_problems()
    if cluster.dry_run_requested(sys.argv):
        for _p in _problems + _profile_problems():
            logger.warning(f"hybridrl (dry run; a real run stops here): {_p}")
    elif _problems:
        raise WorkflowError(
            "hybridrl: nothing was submitted:\n"
            + "\n".join(f"  - {p}" for p in _problems)
        )


def slurm_preflight() -> list[str]:
    """Problems of the jobs that would go to sbatch, judged on their evaluated resources."""
    controller = cluster.check_controller()
    if controller:  # nothing else can be asked of a cluster that does not answer
        return controller
    settings = workflow.executor_settings
    jobs = [job for job in workflow.dag.needrun_jobs() if not job.is_local]
    problems = cluster.check_gpu_profile(
        _gpu_limit(),
        workflow.resource_scopes.get("gpu"),
        sum(1 for job in jobs if job.resources.get("gpu")),
    )
    problems += cluster.check_status_source(
        cluster.slurm_config(),
        getattr(settings, "status_command", None),
        getattr(settings, "init_seconds_before_status_checks", 40) or 40,
    )
    partitions = cluster.cluster_partitions()
    by_rule = {}
    for job in jobs:
        by_rule.setdefault(job.rule.name, []).extend(
            cluster.check_job_resources(job.resources, partitions)
        )
    return problems + cluster.group_problems(by_rule)


onstart:
    if (
        workflow.is_main_process
        and getattr(workflow.executor_plugin, "name", None) == "slurm"
    ):
        _problems = slurm_preflight()
        if _problems:
            raise WorkflowError(
                "hybridrl: nothing was submitted:\n"
                + "\n".join(f"  - {p}" for p in _problems)
            )
