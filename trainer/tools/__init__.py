"""The commands (`ringtrain <tool> ...`, ringtrain/__main__.py), each a Hydra app with its primary
config in conf/, and what they share (app.py, checkpoint_model.py). May import anything in
ringtrain; nothing in ringtrain imports them.
"""
