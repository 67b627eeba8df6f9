"""incident"""
