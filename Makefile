test:
	python -m pytest -q

# the GPU checks (tests marked gpu, bench/trainer_overhead.py --device cuda), one summary;
# every check skips on a machine without an NVIDIA GPU
gpu-check:
	python bench/gpu_check.py

lint:
	ruff check det_local tests bench examples tools
	ruff format --check det_local tests bench examples tools
	mypy det_local
	python tools/walls.py

bench:
	python bench/cli_startup.py
	python bench/run_overhead.py
	python bench/metrics_rate.py
	python bench/trainer_overhead.py
	python bench/checkpoint_io.py
	python bench/queue_throughput.py
	python bench/preemption.py
	python bench/daemon_footprint.py
	python bench/launch_overhead.py
	python bench/asha_sim.py
	python bench/dashboard.py
	python bench/dashboard_flood.py
	python bench/trial_start.py
