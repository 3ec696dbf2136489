"""The runtimes shipped in the tree: one handler per file, each over a well-kept library.

Catalog entries name them as `handler = "omni.runtimes.<module>:<Class>"`:

- `pocketsphinx_asr:PocketsphinxASR`: speech to text, real US English model in its wheel;
- `whisper_asr:WhisperASR`: speech to text with a Whisper checkpoint (transformers);
- `text_classifier:TextClassifier`: sequence-classification checkpoints (transformers);
- `silero_vad_runtime:SileroVAD`: where speech is, real weights in the silero-vad wheel;
- `language_id:LanguageID`: which language a text is in, the real model in the py3langid
  wheel;
- `mtcnn_faces:MTCNNFaces`: face boxes, real weights in the facenet-pytorch wheel (run in a
  model environment of its own: see its docstring).

Where the weights come from is decided by the model directory (model_config.py): files
in the library's own layout, or, for libraries whose PyPI package carries its weights,
an `omni-model.toml` that says `weights = "package"`.
"""
