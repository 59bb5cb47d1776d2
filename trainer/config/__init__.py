"""The configuration: every command's Hydra app, the checked job, the data, task and model
nodes, a checkpoint's recipe and its replay, the sweep summary (a module each).

May import: the packages below it in docs/ARCHITECTURE.md, except ringtrain.checkpoints. Never
the loop, the job or the tools.
"""
