"""The leased-GPU driver's plans (plans.py, written with plan.py's helpers), their items (items.py), how each item
runs (runners.py) and the scheduler (driver.py); `python -m hybridrl.tools.lease`, started by
scripts/gpu/run_reference.sh, which keeps only the transfer and polling glue. Standard library only: it runs on the
GPU machine's python3 with the controller's few wheels. docs/gpu.md has the lease, call by call.
"""
