"""Array machinery several formats share: zarr arrays as TensorStore and Orbax write them.

schema.py parses the JSON files beside the arrays (zarr metadata, `_sharding`, Orbax's tree
and step metadata); reading.py opens the arrays and reads regions of them. Below the format
packages: the Orbax, msgpack and Megatron packages use it, and it imports none of them.
"""
