"""The torch.save machinery several formats share, without torch.

safe_pickle.py: the allow-list unpickler (exact (module, name) pairs; DCP's
`.metadata` and torch.save payloads); payload.py: the torch.save archive
reader (a zip holding data.pkl and the storages, read by byte ranges);
pickle_writer.py: writes the pickles torch.load reads back (DCP's bytes items
and tensor archives). DCP uses all three; torch-world formats build on them.
"""
