"""The configuration: typed schemas and their validation, `_target_` components and their
checks (model, data, task, optimizer, schedule, strategy), the command line's early checks,
Hydra resolvers and the sweep callback.

Everything here runs before any work starts (no process group, data or model), so a
mistake is one line and exit 2.
May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints, ringtrain.data,
ringtrain.strategies. Never the loop, the job or the tools.
"""
