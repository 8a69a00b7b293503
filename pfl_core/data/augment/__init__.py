"""Training augmentations as host-side draws plus pure tensor functions: CIFAR crop + flip
(:mod:`.crop_flip`) and Office/DomainNet flip + rotation (:mod:`.flip_rotate`). The engine applies
them per sample to a method's training streams (:mod:`pfl_core.engine.augmentation`)."""
