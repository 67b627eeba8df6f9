"""diff"""
