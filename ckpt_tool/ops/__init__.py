"""Operations over opened checkpoints and run roots, one module or package per command's core: convert
(engine.py and the parts beside it), reshard, diff, runs (ls, latest), validate/, manifest/,
inspect, the destination directory's rules. Over the registry (formats/); never prints.
"""
