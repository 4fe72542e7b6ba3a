"""What every stage is built from: its command line from dataclasses (`stage_cli`), one error path (`stage_errors`), child-process helpers (`processes`)."""
