"""Research probes, one folder per question: experiments/README.md."""
