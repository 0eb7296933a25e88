"""The seams: the runtime imports no training code."""

import subprocess
import sys

TRAINING_MODULES = ("lightning", "pytorch_lightning", "torchmetrics", "curkv_train.training.objective", "curkv_train.training.data",
                    "curkv_train.training.scored_attention", "curkv_train.training.system", "curkv_train.training.callbacks", "curkv_train.training.reconstruction")


def test_importing_the_runtime_loads_no_training_code():
    code = ("import sys, curkv_train.runtime\n"
            "print('\\n'.join(sorted(name for name in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "curkv_train.runtime.cache" in loaded  # the import did happen
    offenders = [name for name in loaded if name.startswith(TRAINING_MODULES)]
    assert offenders == []
