"""A small residual CNN on generated images of shapes and textures.

``data.load`` makes the data, ``model.cnn`` builds the target model, and ``tune.yaml`` tunes it:
``hydro tune examples/cnn/tune.yaml``.
"""
