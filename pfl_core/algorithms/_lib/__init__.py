"""What the methods share that is not a method: maths used by one or a few methods (pFedGP's GP
and tree, FedL2P's hypergradient, meta-net inputs and fine-tune recipes, MetaVers' episodes and
margin losses), functional optimisers, head/body splits and round learning-rate schedules."""
