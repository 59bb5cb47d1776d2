"""The configuration: typed schemas and their validation, `_target_` components and their
checks, the command line's early checks, Hydra resolvers and the sweep callback.

Everything here runs before any work starts (no process group, data or model), so a
mistake is one line and exit 2. May import: ringtrain.errors, ringtrain.strategies (the
strategy components check their own options), and of ringtrain.checkpoints the modules that
import neither config nor the loop (atomic writes, run directory names, reading a checkpoint).
"""
