"""Post-run analyses of a finished run's model (``evaluation.analyses`` of a run configuration):
each adds metrics and named arrays (logged as ``<name>.npz`` artifacts) to the run's result.

* ``embeddings`` (:mod:`.embeddings`): test embeddings for the t-SNE of MetaVers Figure 2;
* ``dlg`` (:mod:`.leakage`): the DLG reconstruction of one training image from the gradient the
  client would share (MetaVers Figure 3);
* ``personalization`` (:mod:`.personalization`): FedL2P Table 6's ARI and the data of Figures 2-5
  from the per-client arrays of protocol ``finetune_pretrained``.
"""
from pfl_core.analysis.base import (ANALYSES, ANALYSIS_METRICS, AnalysisOutput, parse_analyses,  # noqa: F401
                                    run_analyses)
from pfl_core.registry import import_package_modules  # noqa: E402

import_package_modules(__name__, __path__)  # embeddings, leakage, personalization register themselves
