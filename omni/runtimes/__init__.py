"""The runtimes shipped in the tree: one handler per file, each over a well-kept library.

Catalog entries name them as `handler = "omni.runtimes.<module>:<Class>"`:

- `pocketsphinx_asr:PocketsphinxASR`: speech to text, real US English model in its wheel;
- `whisper_asr:WhisperASR`: speech to text with a Whisper checkpoint (transformers);
- `text_classifier:TextClassifier`: sequence-classification checkpoints (transformers);
- `silero_vad_runtime:SileroVAD`: where speech is, real weights in the silero-vad wheel;
- `language_id:LanguageID`: which language a text is in, the real model in the py3langid
  wheel;
- `mtcnn_faces:MTCNNFaces`: face boxes, real weights in the facenet-pytorch wheel (run in a
  model environment of its own: see its docstring);
- `seq2seq:Seq2Seq`: translation and summarization with a T5/BART/Marian checkpoint
  (transformers);
- `text_to_image:TextToImage`: a PNG from a prompt, with a diffusers pipeline (Stable
  Diffusion), which OpenAI's /v1/images/generations serves;
- `image_classifier:ImageClassifier`, `object_detector:ObjectDetector`,
  `image_captioner:ImageCaptioner`: classes, boxes and captions of PNG or JPEG images with
  transformers checkpoints (images.py reads the files, within a pixel limit).

Where the weights come from is decided by the model directory (model_config.py): files
in the library's own layout, or, for libraries whose PyPI package carries its weights,
an `omni-model.toml` that says `weights = "package"`.
"""
