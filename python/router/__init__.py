"""The data-parallel router: one public endpoint over many radixgen servers (`radixgen router`)."""
