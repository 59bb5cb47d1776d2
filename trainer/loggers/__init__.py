"""The loggers of the `logger` config group (conf/logger/<name>.yaml): each receives one run's
hyperparameters and metrics through the interface in base.py, on rank 0 only. tensorboard.py
and csv.py need nothing beyond ringtrain's own dependencies; wandb.py and mlflow.py need their
extras (`pip install 'ringtrain[wandb]'`, `'ringtrain[mlflow]'`)."""
