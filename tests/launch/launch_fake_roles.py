"""``python -m bpstrain.launch`` with the scheduler/servers replaced by fake_role.py."""

import sys
from pathlib import Path

from bpstrain.launch import LocalServices
from bpstrain.launch._cli import main

LocalServices.role_cmd = [sys.executable, str(Path(__file__).with_name("fake_role.py"))]
sys.exit(main())
