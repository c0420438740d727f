"""The parts of ``scripts/train_digits_video.py`` (the command line, its module docstring the description
of the whole run): ``config`` (the run's configuration and the sizes it implies), ``data`` (the training
digits' .npz and the fixed held-out clips), ``training`` (the text encoder, the VAE and the transformer,
trained in one wall-clock budget), ``measure`` (the pipeline saved, loaded back and measured).

The script puts ``scripts/`` on the path and imports this package as ``digits_video``.
"""
