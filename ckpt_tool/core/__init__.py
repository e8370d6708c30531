"""The format-neutral core: the checkpoint model (model.py), values and filters, the write plan a
writer is handed (write_plan.py), codecs, casts, and the typed contract every format package
implements (contract.py). Over base and storage; names no format.
"""
