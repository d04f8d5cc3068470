"""Models that answer batches of items (sentence encoders, classifiers, any tensor model): the models,
the dynamic batcher in front of them, and run_encoder, the way every protocol runs one."""
