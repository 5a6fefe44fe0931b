"""What a stage's exit status means, for every stage and every orchestrator (the table is in docs/training.md):

* ``OK`` (0): the stage is done.
* ``USER_ERROR`` (2): the spec or an input must be fixed; a retry cannot help (orchestrators do not retry it).
* ``RETRY`` (75, ``EX_TEMPFAIL``): an infrastructure failure or a preemption: a retry of the same command resumes
  from what was committed (Airflow's task retries run for it).
"""
OK = 0
USER_ERROR = 2
RETRY = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"
