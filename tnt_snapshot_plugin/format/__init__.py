"""The bytes a snapshot holds: its on-disk formats, and what the plugin adds to every format.

* :mod:`.base`: the format seam (``Format``: write, check, read); :mod:`.registry`: which formats
  there are, and a snapshot's; :mod:`.torchsnapshot`: torchsnapshot's format (the default);
  :mod:`.dcp`: DCP's format (``torch.distributed.checkpoint``).
* The plugin's own, whatever the format: :mod:`.index` (each snapshot's sealed index: its files'
  sizes and checksums, its commit sequence number), :mod:`.checksums`, :mod:`.verify` (whether a
  snapshot is intact), :mod:`.listing` (what a dirpath holds, also in words), :mod:`.files` (a
  snapshot's files as a format reads them), :mod:`.objects` (how pickled objects are loaded),
  :mod:`.structure` (whether pieces of a tensor tile it).
"""
