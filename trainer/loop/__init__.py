"""The training loop of one rank: fit (top to bottom) and what it uses, one module a concern
(docs/ARCHITECTURE.md walks through them).

May import: everything below the job (ringtrain.config and what it may). Never the job
(ringtrain.run) or the tools.
"""
