"""The tensor layer: collectives on numpy, TensorFlow, Keras and cupy values,
fused by dtype into flat buffers for the transports."""
