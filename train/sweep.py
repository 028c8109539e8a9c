"""`python -m train.sweep`: ablation sweeps: the documented path; the code lives in
`train.experiments.sweep`."""

from train.experiments.sweep import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
