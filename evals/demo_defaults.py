"""The demo's defaults, in a module that imports nothing: the command line builds its parser (for every
command, ``fp4vis info`` included) from them without loading the model libraries."""

DEMO_POLICIES = ("bf16", "fast", "accurate", "guard")
DEFAULT_LIMIT = 200      # held-out digits per image model
DEFAULT_CLIPS = 10       # prompts of the video model: one per digit (fp4vis.evals.demo_video)
VIDEO_MODEL = "fp4vis:digits-wan"
