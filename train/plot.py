"""`python -m train.plot`: metrics plots of runs, sweeps and recipes: the documented path; the code
lives in `train.experiments.plot`."""

from train.experiments.plot import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
