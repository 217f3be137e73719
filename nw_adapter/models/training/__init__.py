"""Training of the tiny digits model, in the stages IP-Adapter is trained in.

1. :mod:`~.autoencoder`: the VAE (reconstruction + KL), 32 x 32 x 3 <-> 4 x 8 x 8.
2. :mod:`~.image_encoder`: the CLIP vision encoder, pretrained as a digit classifier, then frozen.
3. :mod:`~.text_encoder`: the CLIP text encoder, pretrained to name the digit of a caption from
   its states (the digits and "no digit"), then frozen.
4. :mod:`~.diffusion` (stage 1): the UNet, epsilon prediction, conditioned on the frozen text
   encoder's states of captions that name the digit (15% caption dropout to the empty prompt).
5. :mod:`~.diffusion` (stage 2): only the IP-Adapter (image projection, ``to_k_ip``, ``to_v_ip``)
   on (reference, target) pairs of the same class with a class-free prompt.

:mod:`~.run` chains the stages, writes each one atomically and assembles the shipped folder.
"""
