"""The front end's side of text generation: prompts to token ids (chat templates included),
the engine's token stream back to text (incremental detokenization, stop strings), and the
pipeline that admits a request and reads its stream. Torch-free and transformers-free."""
