"""What a sweep's records show: the report and everything it reads.

`report` writes a sweep's Markdown report from its run directories
(`experiments.rundir.records`): the accuracy tables of every model selection
method (`model_selection`), the WILDS table (`wilds_report`), where the runs
ended (`experiments.runs.convergence`), the training curves of every
method (`curves`), and the paper's claims (`claims`), with the figures of
`plots`. Nothing that trains imports this package.
"""
