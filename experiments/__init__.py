"""specjax's experiment binaries and the modules they share (a package of the project: run a binary as
`python -m experiments.generate` or `python experiments/generate.py`; both import `experiments.X`)."""
