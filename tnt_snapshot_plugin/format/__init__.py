"""torchsnapshot's on-disk format, written and read by the plugin itself.

A snapshot is a directory: payload files, and ``.snapshot_metadata`` (JSON) holding the manifest,
one record per saved value, in torchsnapshot's own schema. Stock torchsnapshot (and torchtnt's
saver) read what the plugin writes, and the plugin reads what they write.

* :mod:`.common`: what writer and reader share (path encoding, dtype names, tensor bytes).
* :mod:`.writer`: state dicts -> manifest records and payloads (small tensors packed).
* :mod:`.reader`: manifest records + payload bytes -> state dicts, read into the target tensors.
"""
