"""ringtrain's configs, installed with the package as `ringtrain.conf` so that the commands
find them after a plain `pip install` (Hydra's `pkg://ringtrain.conf`). No code lives here."""
