"""dtq's benchmarks: ``python -m bench`` (``make bench``); see bench/README.md."""
